"""Sub-model specs and the two operations that move weights between global model and client."""

from hfl.submodel.spec import (
    SubmodelSpec,
    block_keys,
    drop_blocks,
    extract,
    freeze,
    full_spec,
    scatter,
    shape_model,
    truncate,
    width_spec,
)

__all__ = [
    "SubmodelSpec", "block_keys", "drop_blocks", "extract", "freeze", "full_spec", "scatter", "shape_model",
    "truncate", "width_spec",
]
