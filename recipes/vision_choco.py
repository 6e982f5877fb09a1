"""Decentralized Choco-SGD training of a CNN (SPEC 8 optimizer; defaults sized for a CPU run on digits).

    python recipes/vision_choco.py --nodes 4 --skew 0.4 --comp 90 --epochs 30
    python recipes/vision_choco.py --dataset cifar10 --arch resnet20 --nodes 8 --epochs 200 --comp 90
    torchrun --nproc_per_node 4 recipes/vision_choco.py --backend distributed
    accelerate launch --num_processes 4 recipes/vision_choco.py --backend distributed  # on CPU as well

`--help` lists every flag (every TrainingArguments flag, transformers spelling, is accepted); results land
in --output-dir (results.json, cost_report.json, kernels.json, metrics.csv, model/).
"""
from lp_decentral_nlp.commands import recipe_main

if __name__ == "__main__":
    recipe_main("vision", "choco")
