"""The request and response types of the approval pause.

They live in an importable module (not ``__main__``) because checkpoints
store them by ``module:qualname``, and they are listed in
``FileCheckpointStorage(allowed_checkpoint_types=CHECKPOINT_TYPES)``:
without that the pause checkpoint is silently not saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class FunctionApprovalRequest:
    """Emitted with ``ctx.request_info``: a function call waiting for a human."""

    request_id: str
    function_name: str
    arguments: dict[str, Any]
    question: str


@dataclass
class SignedDelivery:
    """The answer to a ``FunctionApprovalRequest``: approvald's delivery as it
    arrived, signature headers and raw body. The response handler verifies it
    itself, so only an outcome that came through approvald can act."""

    headers: dict[str, str] = field(default_factory=dict)
    body: str = ""


CHECKPOINT_TYPES = [
    f"{__name__}:FunctionApprovalRequest",
    f"{__name__}:SignedDelivery",
]
