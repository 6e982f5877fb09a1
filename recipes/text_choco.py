"""Decentralized Choco-SGD fine-tuning on your own text classification data (defaults: SPEC section 8).

    python recipes/text_choco.py --data-dir reviews.csv --skew 0.9 --comp 99   # columns text,label
    torchrun --nproc_per_node 4 recipes/text_choco.py --data-dir reviews.csv --backend distributed

--data-dir: a CSV file with text,label columns (the labels, integers or strings, are the classes), a
folder of train.csv (and test.csv, else validation.csv, as the test split), or a
DatasetDict.save_to_disk folder. `--help` lists every flag; results land in --output-dir
(results.json, cost_report.json, kernels.json, metrics.csv, model/).
"""
from lp_decentral_nlp.commands import recipe_main

if __name__ == "__main__":
    recipe_main("nlp", "choco", task="text")
