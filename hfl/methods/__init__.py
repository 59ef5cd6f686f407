"""Federated methods, one file each, declared here with their papers so that listing them imports
nothing; a method's module is imported (and registers its class) when a run asks for it."""

from hfl.registry import METHODS

METHODS.declare("fedavg", "hfl.methods.fedavg", paper="McMahan et al., AISTATS 2017 (arXiv:1602.05629)",
                summary="every client trains the whole model; the server averages weighted by data size")
METHODS.declare("fedprox", "hfl.methods.fedprox", paper="Li et al., MLSys 2020 (arXiv:1812.06127)",
                summary="FedAvg with a proximal term mu/2 ||w - w_t||^2 in the client loss")
METHODS.declare("heterofl", "hfl.methods.heterofl", paper="Diao, Ding and Tarokh, ICLR 2021 (arXiv:2010.01264)",
                summary="each client trains the upper-left width-r slice of every layer, r fitted to its budget")
METHODS.declare("fedrolex", "hfl.methods.fedrolex", paper="Alam et al., NeurIPS 2022 (arXiv:2212.01548)",
                summary="HeteroFL with a window of channels that rolls by one every round")
METHODS.declare("fjord", "hfl.methods.fjord", paper="Horváth et al., NeurIPS 2021 (arXiv:2102.13451)",
                summary="ordered dropout: every batch trains a width drawn up to the client's widest fitting width")
METHODS.declare("depthfl", "hfl.methods.depthfl", paper="Kim, Yu, Kim and Moon, ICLR 2023 (openreview.net/forum?id=pf8RIZTMU58)",
                summary="depth prefixes with a classifier per stage and mutual self-distillation")
METHODS.declare("scalefl", "hfl.methods.scalefl", paper="Ilhan, Su and Liu, CVPR 2023 (github.com/git-disl/scale-fl)",
                summary="levels scaled in width and depth at once, early exits, self-distillation")
METHODS.declare("decoupled", "hfl.methods.decoupled", paper="the Decoupled baseline of Ilhan, Su and Liu, CVPR 2023 (ScaleFL)",
                summary="one separate model per complexity level, each trained by its level's clients")
METHODS.declare("feddf", "hfl.methods.feddf", paper="Lin, Kong, Stich and Jaggi, NeurIPS 2020 (arXiv:2006.07242)",
                summary="HeteroFL's clients, then the server distils the ensemble of client models into the global one")
METHODS.declare("nefl", "hfl.methods.nefl", paper="Kang, Cha, Kim and Kim, 2023 (arXiv:2308.07761)",
                summary="nested sub-models scaled in width and depth with learnable step sizes and per-sub-model norms")
METHODS.declare("splitmix", "hfl.methods.splitmix", paper="Hong, Wang, Wang and Zhou, ICLR 2022 (arXiv:2203.09747)",
                summary="independent narrow base models; a client trains as many as its budget allows, mixed at inference")
METHODS.declare("fedepth", "hfl.methods.fedepth", paper="Zhang, Dai, Wang, Xing, Chen and Sun, AAAI 2024 (arXiv:2303.04887)",
                summary="every client trains the whole model depth-wise, in block groups that fit its budget")
METHODS.declare("mfedepth", "hfl.methods.mfedepth", paper="Zhang, Dai, Wang, Xing, Chen and Sun, AAAI 2024 (arXiv:2303.04887)",
                summary="FeDepth where budgets that hold several models train them with mutual distillation")
METHODS.declare("flpqsu", "hfl.methods.flpqsu", paper="Xu, Hu, Zhu, Wu and Chen, IEEE Access 2021 (FedMef's FL-PQSU baseline)",
                summary="one-shot L1 magnitude pruning of the initial model, then FedAvg with the mask fixed")
METHODS.declare("fedtiny", "hfl.methods.fedtiny", paper="Huang et al., ICDCS 2023, as FedMef compares with it",
                summary="dynamic sparse training: the server drops the smallest weights and grows pruned ones by clients' top-k gradients")
METHODS.declare("fedmef", "hfl.methods.fedmef", paper="Huang, Zhuang, Chen and Lyu, CVPR 2024",
                summary="FedTiny with budget-aware extrusion of the weights to drop and scaled activation pruning")
METHODS.declare("feddst", "hfl.methods.feddst", paper="Bibikar, Vikalo, Wang and Chen, AAAI 2022 (arXiv:2112.09824)",
                summary="sparse clients prune and regrow their own masks mid-round; the server averages holders, re-prunes the union")
METHODS.declare("caff", "hfl.methods.caff", paper="Pfeiffer, Ahmed, Khalili and Henkel, 2024",
                summary="picks the family member maximising the clients' mean trained blocks; each trains its last t blocks")
METHODS.declare("hetlora", "hfl.methods.hetlora", paper="Cho, Liu, Xu, Fahrezi and Joshi, 2024 (arXiv:2401.06432), as CAFF's appendix B runs it",
                summary="low-rank adapters on a pretrained transformer's block linears, the rank fitted to each client's budget")
METHODS.declare("fedhm", "hfl.methods.fedhm", paper="Yao, Pan, O'Neill, Dai, Wan, Jin and Sun, 2021 (arXiv:2111.14655), as CAFF's appendix B runs it",
                summary="clients train low-rank SVD factors of the dense model's block linears, the rank fitted to their budget")
