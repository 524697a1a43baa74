"""Communication: layouts (:mod:`.layout`), the pure stages (:mod:`.stages`), the exact
collectives over ``torch.distributed`` (:mod:`.collective`) and the one helper every side
collective goes through (:mod:`.group`)."""

from .collective import COLLECTIVES, Communicator, exact_allreduce, wire_bytes
from .layout import KERNELS, ShardLayout, fp32_allreduce_wire_bytes
from .stages import (
    all_finite,
    decode,
    decode_gathered,
    decode_sum,
    encode,
    encode_reduced,
    encode_with_error,
    rounding_error,
    simulate_exact_allreduce,
)

__all__ = ["COLLECTIVES", "KERNELS", "Communicator", "ShardLayout", "all_finite", "decode",
           "decode_gathered", "decode_sum", "encode", "encode_reduced", "encode_with_error",
           "exact_allreduce", "fp32_allreduce_wire_bytes", "rounding_error",
           "simulate_exact_allreduce", "wire_bytes"]
