"""approvald's Python client: enqueue approvals, read and cancel operations,
and verify the signed deliveries approvald POSTs to an effect target.

Standard library only.
"""

from .client import ApprovaldClient, ApprovaldError
from .delivery import (
    STATUSES,
    TOLERANCE_SECS,
    Delivery,
    InvalidDelivery,
    Subject,
    decode_secret,
    parse_delivery,
    sign,
    verify_delivery,
    verify_signature,
)

__all__ = [
    "ApprovaldClient",
    "ApprovaldError",
    "Delivery",
    "InvalidDelivery",
    "STATUSES",
    "Subject",
    "TOLERANCE_SECS",
    "decode_secret",
    "parse_delivery",
    "sign",
    "verify_delivery",
    "verify_signature",
]

__version__ = "0.1.0"
