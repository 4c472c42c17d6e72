import json
import os

import torch
from click.testing import CliRunner

import distckpt
from distckpt.cli import main
from tests.leftovers import leave_crashed_save


def test_inspect_and_verify(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(3, 4, dtype=torch.bfloat16), "step": 5}, checkpoint_id=path)
    runner = CliRunner()
    res = runner.invoke(main, ["inspect", path])
    assert res.exit_code == 0, res.output
    assert "w" in res.output and "bfloat16" in res.output and "(3, 4)" in res.output
    res = runner.invoke(main, ["inspect", path, "--json"])
    doc = json.loads(res.output)
    assert {e["key"] for e in doc["keys"]} == {"w", "step"} and doc["format_version"] == "3.0"
    res = runner.invoke(main, ["verify", path])
    assert res.exit_code == 0 and res.output.startswith("ok: 2 keys")


def test_verify_exit_codes_for_damage_and_absence(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.randn(64)}, checkpoint_id=path)
    name = next(n for n in os.listdir(path) if n.endswith(".safetensors"))
    data = bytearray(open(os.path.join(path, name), "rb").read())
    data[-5] ^= 0xFF
    open(os.path.join(path, name), "wb").write(bytes(data))
    runner = CliRunner()
    res = runner.invoke(main, ["verify", path])
    assert res.exit_code == 1 and "checksum mismatch" in res.output
    res = runner.invoke(main, ["verify", str(tmp_path / "nope")])
    assert res.exit_code == 3 and "does not exist" in res.output  # a wrong path is not damage
    res = runner.invoke(main, ["inspect", str(tmp_path / "nope")])
    assert res.exit_code == 3
    with open(os.path.join(path, "metadata.json"), "r+b") as f:
        f.write(b"garbage")
    res = runner.invoke(main, ["inspect", path])
    assert res.exit_code == 1
    res = runner.invoke(main, ["frobnicate"])
    assert res.exit_code == 2


def test_steps_lists_a_run_and_cleans_crash_leftovers(tmp_path):
    from distckpt.backends.filesystem import FsStore

    root = str(tmp_path / "run")
    mgr = distckpt.CheckpointManager(root)
    for step in (10, 20):
        mgr.save(step, {"w": torch.ones(256), "step": step})
    leave_crashed_save(FsStore(os.path.join(root, "step-30")), "crashed")  # as a save killed mid-way leaves it
    hidden = [n for n in os.listdir(root) if n.startswith(".")]
    assert hidden
    runner = CliRunner()
    res = runner.invoke(main, ["steps", root])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert [line.split()[1] for line in lines] == ["10", "20"] and lines[-1].endswith("(newest)")
    assert " kB " in lines[0]  # decimal, as the progress bars count
    assert [n for n in os.listdir(root) if n.startswith(".")] == hidden  # listing removes nothing
    res = runner.invoke(main, ["steps", root, "--clean", "--json"])
    doc = json.loads(res.output)
    assert [s["step"] for s in doc["steps"]] == [10, 20] and doc["steps"][0]["keys"] == 2
    assert len(doc["removed"]) == 1 and not [n for n in os.listdir(root) if n.startswith(".")]  # its lease too
    os.mkdir(tmp_path / "empty")
    res = runner.invoke(main, ["steps", str(tmp_path / "empty")])
    assert res.exit_code == 0 and "no committed steps" in res.output
    res = runner.invoke(main, ["steps", str(tmp_path / "nope")])
    assert res.exit_code == 3 and "not a directory" in res.output and not (tmp_path / "nope").exists()


def test_help_and_version_start_without_importing_torch():
    import subprocess
    import sys

    code = ("import sys\nfrom distckpt.cli import main\nfor args in (['--help'], ['--version'], ['convert', '--help']):\n"
            "    try:\n        main(args)\n    except SystemExit as e:\n        assert e.code == 0, (args, e.code)\n"
            "assert 'torch' not in sys.modules, 'the CLI imported torch for --help'\nimport distckpt\n"
            "assert 'torch' not in sys.modules\nassert callable(distckpt.save) and 'torch' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _dcp_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def test_what_a_new_user_reads_is_one_count_of_keys_in_plain_lines(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(_dcp_state(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    runner = CliRunner()
    res = runner.invoke(main, ["verify", str(tmp_path / "dcp")])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("ok: ") and "a DCP checkpoint" in res.output and "no checksums" in res.output
    assert "Reader" not in res.output
    res = runner.invoke(main, ["convert", "--from", "dcp", str(tmp_path / "dcp"), str(tmp_path / "ours")])
    assert res.exit_code == 0, res.output
    assert "from DCP checkpoint" in res.output and "distckpt checkpoint " + str(tmp_path / "dcp") not in res.output
    stored = len(distckpt.read_metadata(tmp_path / "ours").state_dict_metadata)
    assert f"ok: {stored} keys converted" in res.output
    inspected = runner.invoke(main, ["inspect", str(tmp_path / "ours")]).output
    verified = runner.invoke(main, ["verify", str(tmp_path / "ours")]).output
    assert f", {stored} keys," in inspected and verified.startswith(f"ok: {stored} keys in ")
    # damage: one real line per problem, no literal backslash-n
    path = tmp_path / "ours"
    name = next(n for n in os.listdir(path) if n.endswith(".safetensors"))
    data = bytearray((path / name).read_bytes())
    data[-3] ^= 0xFF
    (path / name).write_bytes(bytes(data))
    res = runner.invoke(main, ["verify", str(path)])
    assert res.exit_code == 1 and "\\n" not in res.output and res.output.count("\n") >= 2, res.output
