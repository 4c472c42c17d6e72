"""The messages of a save between ranks, each in the most compact form that holds it exactly.

A rank's plan goes as a column frame where the save plans on columns and the
plan is regular, else as JSON; the coordinator's reply as a keep mask over
the rank's own plan, else as the central plan in JSON; a rank's write results
as result columns where they follow its central plan item for item, else as
JSON. Decoders tell the forms apart by the frame's magic, so the call
sequence hands every message to one encoder and one decoder.
"""

from __future__ import annotations

from typing import Any, Union

from ..format.codec import dumps, loads
from ..item_columns import ColumnResults, PlanColumns, ResultColumns
from ..planner import SavePlan
from .columns import (
    KEEP_MAGIC,
    PLAN_MAGIC,
    RESULTS_MAGIC,
    decode_keep,
    decode_plan_columns,
    decode_result_columns,
    encode_plan_columns,
    encode_result_columns,
)
from .frames import frame_kind
from .plans import decode_save_plan, decode_write_results, encode_save_plan, encode_write_results

__all__ = ["encode_plan", "decode_plan", "encode_reply", "decode_reply", "encode_results", "decode_results",
           "result_columns"]


def encode_plan(plan: SavePlan, columns: bool) -> bytes:
    """A rank's local plan; as a column frame where ``columns`` and the plan has the regular shape columns hold."""
    raw = encode_plan_columns(plan) if columns and plan.usable else None
    return raw if raw is not None else dumps(encode_save_plan(plan))


def decode_plan(raw: bytes) -> Union[PlanColumns, SavePlan]:
    if frame_kind(raw) == PLAN_MAGIC:
        return decode_plan_columns(raw)
    return decode_save_plan(loads(raw, "save plan"))


def encode_reply(reply: Union[bytes, SavePlan]) -> bytes:
    """The coordinator's reply to one rank: a keep frame as it is, a central plan in JSON."""
    return reply if isinstance(reply, bytes) else dumps(encode_save_plan(reply))


def decode_reply(raw: bytes, local: SavePlan) -> tuple[SavePlan, bool]:
    """This rank's central plan, and whether it came as a keep mask over ``local`` (its items are then the
    local plan's own, and its results can travel as columns)."""
    if frame_kind(raw) == KEEP_MAGIC:
        return decode_keep(raw, local), True
    return decode_save_plan(loads(raw, "save plan")), False


def encode_results(results: Any, plan: SavePlan, columns: bool) -> bytes:
    """A rank's write results of ``plan``; as result columns where ``columns`` and they follow the plan."""
    raw = encode_result_columns(results, plan) if columns else None
    return raw if raw is not None else dumps(encode_write_results(results))


def decode_results(raw: bytes) -> Union[ResultColumns, list]:
    if frame_kind(raw) == RESULTS_MAGIC:
        return decode_result_columns(raw)
    return decode_write_results(loads(raw, "write results"))


def result_columns(results: Any) -> Union[ResultColumns, Any]:
    """A rank's results as columns where they are (results that did not travel come as :class:`ColumnResults`)."""
    return results.columns if isinstance(results, ColumnResults) else results
