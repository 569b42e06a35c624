"""Per-module layouts, device placement, module meshes and logical-axis rules."""

from .layout import DEGREES as DEGREES
from .layout import MESH_AXES as MESH_AXES
from .layout import STAGE_AXES as STAGE_AXES
from .layout import Layout as Layout
from .layout import LayoutError as LayoutError
from .placement import ModuleMesh as ModuleMesh
from .placement import Placement as Placement
from .placement import island_positions as island_positions
from .placement import module_meshes as module_meshes
from .placement import module_positions as module_positions
from .placement import place_modules as place_modules
from .placement import validate_layout as validate_layout
from .rules import BATCH_AXES as BATCH_AXES
from .rules import FSDP_AXIS as FSDP_AXIS
from .rules import LOGICAL_AXIS_RULES as LOGICAL_AXIS_RULES
from .rules import activation_sharding as activation_sharding
from .rules import batch_sharding as batch_sharding
from .rules import gathered_spec as gathered_spec
from .rules import is_logical_names as is_logical_names
from .rules import logical_to_sharding as logical_to_sharding
from .rules import logical_to_spec as logical_to_spec
from .rules import param_shardings as param_shardings
from .rules import sequence_axes as sequence_axes
from .sequence import inverse_permutation as inverse_permutation
from .sequence import zigzag_permutation as zigzag_permutation
from .validation import validate_batch as validate_batch
from .validation import validate_divisible as validate_divisible
from .validation import validate_fsdp as validate_fsdp

__all__ = [
    "BATCH_AXES",
    "FSDP_AXIS",
    "gathered_spec",
    "is_logical_names",
    "validate_fsdp",
    "activation_sharding",
    "batch_sharding",
    "sequence_axes",
    "inverse_permutation",
    "zigzag_permutation",
    "DEGREES",
    "LOGICAL_AXIS_RULES",
    "MESH_AXES",
    "STAGE_AXES",
    "Layout",
    "LayoutError",
    "ModuleMesh",
    "Placement",
    "logical_to_sharding",
    "logical_to_spec",
    "param_shardings",
    "island_positions",
    "module_meshes",
    "module_positions",
    "place_modules",
    "validate_batch",
    "validate_divisible",
    "validate_layout",
]
