"""The demonstration: multi-rank FSDP2 training that checkpoints, crashes, resumes and reshards.

Run it with ``python -m distckpt.demo`` (README's first command sets it up).
"""
