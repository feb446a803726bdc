"""One module per op; each class's name matches csrc/ops/<name>.cuh."""
from tpmk.kernels.ops.base import REGISTRY, Instruction, Nop
from tpmk.kernels.ops.embed import Embed
from tpmk.kernels.ops.residual import Residual
from tpmk.kernels.ops.qkv import Qkv
from tpmk.kernels.ops.attention import Attention
from tpmk.kernels.ops.o_proj import OProj
from tpmk.kernels.ops.gate_up import GateUp
from tpmk.kernels.ops.act import Act
from tpmk.kernels.ops.down import Down
from tpmk.kernels.ops.lm_head import LmHead
from tpmk.kernels.ops.argmax import Argmax

__all__ = ["REGISTRY", "Instruction", "Nop", "Embed", "Residual", "Qkv", "Attention", "OProj",
           "GateUp", "Act", "Down", "LmHead", "Argmax"]
