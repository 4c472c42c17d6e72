"""Run one fuzz target under atheris (libFuzzer): ``python tests/fuzz/run.py TARGET [libFuzzer options] [corpus dirs]``.

distckpt's modules are instrumented for coverage as they are imported here (torch and the other libraries
are not). Options and corpus folders go to libFuzzer as they are: libFuzzer writes the inputs it finds
interesting into the first corpus folder it is given and a crashing input to ``-artifact_prefix``, so a
run that must leave the repository alone names a temporary folder first and the committed corpus after
it (tests/fuzz/test_fuzz.py does). ``-rss_limit_mb`` bounds memory, ``-timeout`` one input's time and
``-max_total_time`` the run's.

To grow the committed corpus by hand, fuzz into a scratch folder, then keep the few inputs that add
coverage, named ``found-*``:

    python tests/fuzz/run.py metadata -max_total_time=600 /tmp/new tests/fuzz/corpus/metadata
    python tests/fuzz/run.py metadata -merge=1 /tmp/kept tests/fuzz/corpus/metadata /tmp/new
"""

from __future__ import annotations

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root

import numpy  # noqa: E402,F401 - imported, and so left uninstrumented, before the block below
import torch  # noqa: E402,F401


def main() -> None:
    with atheris.instrument_imports(include=["distckpt"]):
        from tests.fuzz.targets import TARGETS

        if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
            sys.exit(f"usage: run.py TARGET [libFuzzer options] [corpus dirs]; TARGET is one of {', '.join(TARGETS)}")
        name = sys.argv.pop(1)
        target = TARGETS[name]
        target(b"")  # imports the parser, and what it imports of distckpt, instrumented

    from tests.fuzz.mutators import KINDS, json_mutator

    def one_input(data: bytes) -> None:
        target(data)

    def byte_mutate(data: bytes, max_size: int) -> bytes:
        return atheris.Mutate(data, max_size)  # looked up when called: Fuzz() replaces the function Setup() saw

    mutator = json_mutator(KINDS[name], byte_mutate) if name in KINDS else None
    atheris.Setup(sys.argv, one_input, custom_mutator=mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
