"""The cost model's tables (SPEC section 7): precisions, pricing conventions, energy per operation,
optimizer states. Torch-free, so the cost command line can check its flags before importing torch."""

PRECISIONS = ("fp32", "int8")
CONVENTIONS = ("ours", "paper")
# Unit of the memory figures of each convention: name, bytes. The paper's Table 10 "MB" are MiB.
MEMORY_UNITS = {"ours": ("MB", 10**6), "paper": ("MiB", 2**20)}
CONVENTION_TEXT = {
    "ours": "convention ours: backward counted as autograd runs it (no gradient for frozen weights or data); "
            "only what 8-bit training runs in 8 bits is priced int8; the 8-bit layers' weights, "
            "gradients and optimizer state count 8 bits, as SPEC 7's accelerator holds them (lp_decentral_nlp keeps "
            "them fp32); memory in MB (10^6 bytes)",
    "paper": "convention paper (Table 10): SPEC 7's 3x per layer; every add and mult of the 8-bit model priced "
             "int8; inference memory "
             "= the weights alone; memory in MiB (2^20 bytes)",
}
# A quantized layer saves its input for backward as 8-bit codes plus a per-tensor scale and offset (2 x fp32).
SAVED_RANGE_BYTES = 8
# Optimizer state tensors per parameter: SGD (none), SGD with momentum (its buffer), Adam/AdamW (two
# moments); with quasi-global momentum (SPEC 2) one more, the model snapshot it keeps: SGD's buffer and
# snapshot, Adam's moments and snapshot.
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "sgd_qgm": 2, "adam_qgm": 3}
# Energy per operation in picojoules, 45 nm (Horowitz, ISSCC 2014), as SPEC 7 lists.
ENERGY_PJ = {"fp32": {"add": 0.9, "mult": 3.7}, "int8": {"add": 0.03, "mult": 0.2}}
MB = 1e6
