from setuptools import find_packages, setup

setup(
    name="tensorrt_llm_draftkv",
    version="0.1.0",
    description=(
        "Draft-KV pool sizing and addressing for speculative decoding drafters "
        "(DFlash, DSpark, PARD, draft-target one-model) in a TensorRT-LLM-style executor"
    ),
    packages=find_packages(include=["tensorrt_llm_draftkv", "tensorrt_llm_draftkv.*"]),
    # The simulator's embedded scenario is a config file read at import (sim/scenario.py).
    package_data={"tensorrt_llm_draftkv.sim": ["default_scenario.json"]},
    python_requires=">=3.10",
    # Loose on purpose: pinning torch here would replace a CUDA build with a CPU one.
    install_requires=["torch", "triton", "numpy", "tqdm"],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "filelock"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["draftkv=tensorrt_llm_draftkv.__main__:main"]},
)
