"""Coverage-guided fuzzing of every parser of checkpoint bytes (targets.py), as safetensors fuzzes its own.

- ``test_replay``: every file of the committed corpus (corpus/<target>/) through its target, in this process,
  without atheris: fast and deterministic, so an input that once found a bug keeps it fixed.
- ``test_fuzz``: a target under atheris for a few seconds, in a subprocess, so that atheris' instrumentation stays
  out of this process: the metadata target in every run, all of them with ``--run-slow``, which also fuzzes each
  for longer (DISTCKPT_FUZZ_SECONDS, default 120).

A fuzz run writes only inside its temporary folder (the inputs it finds, a crashing input, the DCP target's
``.metadata``), holds at most ``RSS_LIMIT_MB`` of memory, gives one input at most ``INPUT_TIMEOUT_S`` and
ends after its time. A failure shows the crashing input in base64: fix the parser, then add the input to
corpus/<target>/ as ``found-<what>`` so the replay test keeps it. Findings reported to the owners of parsers
this suite does not fix are stepped around by the targets (targets.OPEN_FINDINGS)
until fixed; DISTCKPT_FUZZ_KNOWN=1 in a run by hand (run.py) looks at them again.
"""

from __future__ import annotations

import base64
import os
import pathlib
import resource
import subprocess
import sys

import pytest

from .targets import TARGETS, available

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CORPUS = HERE / "corpus"
RUN = HERE / "run.py"
DICTIONARY = HERE / "fuzz.dict"

BRIEF_S = 3  # a brief run: seconds of fuzzing after the corpus
RSS_LIMIT_MB = 2048
INPUT_TIMEOUT_S = 10
MAX_LEN = 8192
JSON_TARGETS = {"metadata", "datafile", "value", "hf_index", "hf_shard"}


def _require_atheris() -> None:
    try:
        import atheris  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"atheris cannot be imported ({exc}); it is in the test extra: pip install -e '.[test]'", pytrace=False)


def _corpus_files() -> list:
    return [pytest.param(t, p, id=f"{t}/{p.name}") for t in TARGETS for p in sorted((CORPUS / t).glob("*")) if p.is_file()]


@pytest.mark.parametrize("target, path", _corpus_files())
def test_replay(target, path):
    if target not in available():
        pytest.skip(f"the parser of target {target} is not in this tree yet")
    TARGETS[target](path.read_bytes())


def test_every_target_has_a_corpus():
    for target in TARGETS:
        assert len(list((CORPUS / target).glob("seed-*"))) >= 2, f"corpus/{target} has no seeds: run tests/fuzz/make_corpus.py"
    sizes = [p.stat().st_size for p in CORPUS.rglob("*") if p.is_file()]
    assert len(sizes) <= 400 and max(sizes) <= 16 << 10, "keep the committed corpus small: tens of files, a few KB each"


def test_atheris_is_installed():
    _require_atheris()


def _start(target: str, seconds: int, folder: pathlib.Path) -> subprocess.Popen:
    """One fuzz run of ``target`` for ``seconds``, confined to ``folder``."""
    found = folder / "found"
    found.mkdir(parents=True, exist_ok=True)
    # libFuzzer reads the peak RSS (ru_maxrss), which Linux carries from this process into the child through fork
    # and exec: after a long test run it starts at this process's peak, so the limit is counted above it
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    options = [f"-max_total_time={seconds}", f"-rss_limit_mb={RSS_LIMIT_MB + inherited_mb}",
               f"-timeout={INPUT_TIMEOUT_S}", f"-max_len={MAX_LEN}", f"-artifact_prefix={folder}{os.sep}", "-print_final_stats=1"]
    if target in JSON_TARGETS:
        options.append(f"-dict={DICTIONARY}")
    # the first corpus folder is where libFuzzer writes what it finds: a temporary one, the committed corpus after it
    command = [sys.executable, str(RUN), target, *options, str(found), str(CORPUS / target)]
    env = {**os.environ, "TMPDIR": str(folder), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("DISTCKPT_FUZZ_KNOWN", None)
    return subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(target: str, run: subprocess.Popen, seconds: int, folder: pathlib.Path) -> None:
    try:
        out, _ = run.communicate(timeout=seconds + 120)
    except subprocess.TimeoutExpired:
        run.kill()
        out, _ = run.communicate()
        pytest.fail(f"fuzzing {target} did not end {seconds + 120} s after it began:\n{out.decode(errors='replace')[-4000:]}")
    text = out.decode(errors="replace")
    if run.returncode == 0:
        assert "Done " in text, f"fuzzing {target} ended without running:\n{text[-4000:]}"
        return
    found = [p for p in folder.iterdir() if p.is_file() and p.name.split("-")[0] in ("crash", "oom", "timeout", "leak", "slow")]
    shown = "\n".join(f"{p.name}: {base64.b64encode(p.read_bytes()[:4096]).decode()}" for p in found[:3])
    pytest.fail(f"fuzzing {target} found an input its parser mishandles (exit {run.returncode}).\n{text[-6000:]}\n"
                f"input (base64): {shown or 'none written'}\nFix the parser, then add the input to tests/fuzz/corpus/{target}/ "
                "as found-<what>.", pytrace=False)


BRIEF_TARGETS = ("metadata",)  # the format's own document, and what the lifecycle reads of it: the others' brief runs
# are a sweep (--run-slow); their committed corpora replay above in every run


@pytest.mark.parametrize("target", [t if t in BRIEF_TARGETS else pytest.param(t, marks=pytest.mark.slow) for t in TARGETS])
def test_fuzz(target, tmp_path):
    _require_atheris()
    if target not in available():
        pytest.skip(f"the parser of target {target} is not in this tree yet")
    _finish(target, _start(target, BRIEF_S, tmp_path), BRIEF_S, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
def test_fuzz_longer(target, tmp_path):
    _require_atheris()
    if target not in available():
        pytest.skip(f"the parser of target {target} is not in this tree yet")
    seconds = int(os.environ.get("DISTCKPT_FUZZ_SECONDS", "120"))
    _finish(target, _start(target, seconds, tmp_path), seconds, tmp_path)
