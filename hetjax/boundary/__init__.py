"""Boundary communicators: edge specs, transfer plans, transports, the custom_vjp op."""

from .edge import BoundaryError as BoundaryError
from .edge import EdgeSpec as EdgeSpec
from .edge import Endpoint as Endpoint
from .edge import Transform as Transform
from .multiprocess import MultiProcessTransport as MultiProcessTransport
from .op import Boundary as Boundary
from .op import boundary as boundary
from .plan import Copy as Copy
from .plan import Lane as Lane
from .plan import LocalCollective as LocalCollective
from .plan import TransferPlan as TransferPlan
from .plan import make_plan as make_plan
from .plan import naive_device_put_bytes as naive_device_put_bytes
from .transport import InProcessTransport as InProcessTransport
from .transport import Transport as Transport

__all__ = [
    "Boundary",
    "BoundaryError",
    "Copy",
    "EdgeSpec",
    "Endpoint",
    "InProcessTransport",
    "Lane",
    "LocalCollective",
    "MultiProcessTransport",
    "TransferPlan",
    "Transform",
    "Transport",
    "boundary",
    "make_plan",
    "naive_device_put_bytes",
]
