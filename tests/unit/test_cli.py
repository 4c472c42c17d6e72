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


def test_convert_from_hf_takes_the_index_file_users_copy(tmp_path):
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.ones(2)}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.arange(3)}, str(hf / "model-00002-of-00002.safetensors"))
    shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    runner = CliRunner()
    res = runner.invoke(main, ["convert", "--from", "hf", str(hf / "model.safetensors.index.json"), str(tmp_path / "all")])
    assert res.exit_code == 0, res.output
    assert set(distckpt.read_metadata(tmp_path / "all").state_dict_metadata) == {"a", "b"}
    # beside another index, the one named is the one read (the directory alone is ambiguous)
    (hf / "b-only.safetensors.index.json").write_text(json.dumps({"weight_map": {"b": shards["b"]}}))
    res = runner.invoke(main, ["convert", "--from", "hf", str(hf / "b-only.safetensors.index.json"), str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    assert set(distckpt.read_metadata(tmp_path / "b").state_dict_metadata) == {"b"}
    res = runner.invoke(main, ["convert", "--from", "hf", str(hf / "typo.safetensors.index.json"), str(tmp_path / "c")])
    assert res.exit_code == 3 and "typo.safetensors.index.json" in res.output, res.output
    res = runner.invoke(main, ["convert", "--from", "hf", str(tmp_path / "all"), str(tmp_path / "d")])
    assert res.exit_code == 3 and "pass the directory" in res.output, res.output


def test_verify_and_steps_given_each_others_path_name_the_command_that_takes_it(tmp_path):
    root = str(tmp_path / "run")
    mgr = distckpt.CheckpointManager(root)
    for step in (10, 20):
        mgr.save(step, {"w": torch.ones(4), "step": step})
    runner = CliRunner()
    res = runner.invoke(main, ["verify", root])
    assert res.exit_code == 3, res.output
    assert f"`distckpt steps {root}`" in res.output and f"`distckpt verify {mgr.path(20)}`" in res.output
    before = sorted(os.listdir(mgr.path(10)))
    for extra in ([], ["--clean"], ["--json"]):
        res = runner.invoke(main, ["steps", mgr.path(10), *extra])
        assert res.exit_code == 3, (extra, res.output)
        assert f"`distckpt verify {mgr.path(10)}`" in res.output and f"`distckpt steps {root}`" in res.output
    assert sorted(os.listdir(mgr.path(10))) == before  # --clean swept nothing inside the checkpoint
    lone = str(tmp_path / "lone")
    distckpt.save({"w": torch.ones(2)}, checkpoint_id=lone)
    res = runner.invoke(main, ["steps", lone])
    assert res.exit_code == 3 and f"`distckpt verify {lone}`" in res.output and "distckpt steps" not in res.output
    res = runner.invoke(main, ["verify", lone])
    assert res.exit_code == 0 and "distckpt steps" not in res.output


def test_verify_progress_off_a_terminal_is_lines_named_verify(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.randn(1000)}, checkpoint_id=path)
    runner = CliRunner()  # its standard error is not a terminal, as a log file is not
    for mode in ("bar", "log"):
        res = runner.invoke(main, ["verify", path], env={"DISTCKPT_PROGRESS": mode})
        assert res.exit_code == 0 and res.stdout.startswith("ok: 1 keys"), res.output
        assert "\r" not in res.stderr and "load" not in res.stderr, (mode, res.stderr)
        assert "rank 0: verify done" in res.stderr, (mode, res.stderr)
    res = runner.invoke(main, ["verify", path, "--quiet"], env={"DISTCKPT_PROGRESS": "bar"})
    assert res.exit_code == 0 and res.output == ""
    res = runner.invoke(main, ["verify", path], env={"DISTCKPT_PROGRESS": "loud"})
    assert res.exit_code == 4 and "DISTCKPT_PROGRESS='loud'" in res.stderr


def test_help_summarises_every_subcommand():
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0
    summary = res.output.split("Exit codes:")[0]
    missing = [name for name in main.commands if f"distckpt {name} " not in summary]
    assert not missing, f"--help's summary lacks {missing}"


def test_inspect_lists_keys_sorted_and_in_storage_order_on_request(tmp_path):
    path = str(tmp_path / "ck")
    # the metadata stores whole tensors first, values after: "a" last, "layers.10" before "layers.2"
    distckpt.save({"a": 1, "layers": {"10": torch.ones(2), "2": torch.ones(3)}}, checkpoint_id=path)
    runner = CliRunner()

    def listed(*flags):
        res = runner.invoke(main, ["inspect", path, *flags])
        assert res.exit_code == 0, res.output
        return [line.split()[0] for line in res.output.splitlines()[1:] if not line.startswith("  file ")]

    assert listed() == ["a", "layers.2", "layers.10"]
    stored = list(distckpt.read_metadata(path).state_dict_metadata)
    assert listed("--storage-order") == stored == ["layers.10", "layers.2", "a"]
    doc = json.loads(runner.invoke(main, ["inspect", path, "--json"]).output)
    assert [row["key"] for row in doc["keys"]] == ["a", "layers.2", "layers.10"]


def test_inspect_sorts_keys_with_digit_runs_of_any_length(tmp_path):
    path = str(tmp_path / "ck")
    long_run = "9" * 5000  # int() refuses over 4,300 digits
    distckpt.save({f"k{long_run}": torch.ones(1), "k10": torch.ones(1), "k010": torch.ones(1), "k2": torch.ones(1)},
                  checkpoint_id=path)
    res = CliRunner().invoke(main, ["inspect", path])
    assert res.exit_code == 0, res.output
    keys = [line.split()[0] for line in res.output.splitlines()[1:] if not line.startswith("  file ")]
    assert keys == ["k2", "k010", "k10", f"k{long_run}"]


def test_suggested_commands_quote_paths_and_find_the_run_of_a_step_named_from_inside_it(tmp_path, monkeypatch):
    root = tmp_path / "my run"
    mgr = distckpt.CheckpointManager(str(root))
    mgr.save(10, {"w": torch.ones(2)})
    runner = CliRunner()
    res = runner.invoke(main, ["verify", str(root)])
    assert res.exit_code == 3 and f"`distckpt steps '{root}'`" in res.output, res.output
    monkeypatch.chdir(root)
    step = os.path.basename(mgr.path(10))
    res = runner.invoke(main, ["steps", step])
    assert res.exit_code == 3 and f"`distckpt steps '{root}'` lists the run it is a step of" in res.output, res.output


def test_steps_watch_sees_steps_commit_and_go_beside_a_saving_trainer(tmp_path):
    """``steps --watch --json --count 4``: one document a listing, each read from the store alone while a trainer in
    another thread saves with retention; the listings see steps appear and the oldest go."""
    import threading

    root = str(tmp_path / "run")
    mgr = distckpt.CheckpointManager(root, keep_last=2, no_dist=True)
    mgr.save(1, {"w": torch.ones(64)})
    saved = threading.Event()

    def trainer():
        for step in (2, 3, 4):
            mgr.save(step, {"w": torch.full((64,), float(step))})
        saved.set()

    thread = threading.Thread(target=trainer)
    thread.start()
    result = CliRunner().invoke(main, ["steps", root, "--watch", "--json", "--interval", "0.3", "--count", "4"])
    thread.join(60)
    assert result.exit_code == 0, result.output
    docs = [json.loads(line) for line in result.output.splitlines()]
    assert len(docs) == 4 and all(d["error"] is None and d["root"] == root for d in docs)
    seen = [[r["step"] for r in d["steps"]] for d in docs]
    assert all(s == sorted(s) and 1 <= len(s) <= 3 for s in seen), seen
    after = CliRunner().invoke(main, ["steps", root, "--watch", "--count", "1"])
    assert after.exit_code == 0 and "step-0000000003" in after.output and "step-0000000004" in after.output
    assert "step-0000000001" not in after.output and saved.is_set()
