"""Glue for training frameworks that checkpoint through torch.distributed.checkpoint (README, Integrations).

Each module imports its framework (an optional dependency): import the one you use. These modules, like
the conversion and DCP-reading code, may name DCP's own types, where a framework checks for them.
"""
