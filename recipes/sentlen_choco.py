"""Decentralized Choco-SGD fine-tuning on sentlen (defaults: SPEC section 8).

    python recipes/sentlen_choco.py --skew 0.9 --comp 99
    torchrun --nproc_per_node 4 recipes/sentlen_choco.py --backend distributed
    accelerate launch --num_processes 4 recipes/sentlen_choco.py --backend distributed  # on CPU as well

`--help` lists every flag (every TrainingArguments flag, transformers spelling, is accepted); results land
in --output-dir (results.json, cost_report.json, kernels.json, metrics.csv, model/).
"""
from lp_decentral_nlp.commands import recipe_main

if __name__ == "__main__":
    recipe_main("nlp", "choco", task="sentlen")
