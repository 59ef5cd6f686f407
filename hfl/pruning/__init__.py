"""Building blocks of federated pruning (FedMef, FedTiny, FedDST, FL-PQSU), one concern per module.

- `masks`: which state keys are prunable, ERK layer densities, random initial masks.
- `schedules`: adjustment rates (FedMef's ζ_r, FedDST's α_r), per-layer counts, the budgeted LR.
- `selection`: θ_low, the server's prune/grow, the clients' top-k gradients among pruned entries.
- `sap`: scaled activation pruning, Conv2d/Linear layers that keep a compressed top-k input for backward.
- `nsconv`: FedMef's normalized sparse convolution (filter-wise standardisation over kept entries).

How a masked tensor is costed on the wire lives in `hfl.accounting.storage`: every masked tensor is
sent that way, pruned or not. The package imports nothing, like `hfl.accounting`.
"""
