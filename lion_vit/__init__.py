"""lion-vit: LION bidirectional linear attention Vision Transformers, registered with timm.

`import lion_vit` registers lion_{lit,d,s}_{tiny,small,base} and lion_{d,s}_natural_{tiny,small,base} (the
paper's Table 2: LION_MODEL_NAMES), the paper's Table 1 families
lion_{retnet,mamba2,xlstm,gla,hgrn2,rwkv6}[_natural]_{tiny,small,base} (FAMILY_MODEL_NAMES), and each of them
with DeiT's distillation token as <name>_distilled (DISTILLED_MODEL_NAMES: those of Table 2).
"""
from .convert import from_official, to_official
from .from_vit import init_from_vit
from .layers import LionAttention
from .models import DISTILLED_MODEL_NAMES, FAMILY_MODEL_NAMES, LION_MODEL_NAMES, LionViT
from .ops import lion_attention

__version__ = "0.1.0"
__all__ = ["LionAttention", "LionViT", "LION_MODEL_NAMES", "DISTILLED_MODEL_NAMES", "FAMILY_MODEL_NAMES",
           "init_from_vit",
           "from_official", "to_official", "lion_attention"]
