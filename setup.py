from setuptools import find_packages, setup

setup(
    name="tensorrt_llm_draftkv",
    version="0.1.0",
    description=(
        "Draft-KV pool sizing and addressing for speculative decoding drafters "
        "(DFlash, DSpark, PARD, draft-target one-model) in a TensorRT-LLM-style executor"
    ),
    # The library and, beside it, its simulator (which the library never imports).
    packages=find_packages(
        include=["tensorrt_llm_draftkv", "tensorrt_llm_draftkv.*", "draftkv_sim", "draftkv_sim.*"]
    ),
    # The simulator's embedded scenario is a config file read at import (draftkv_sim/scenario.py).
    package_data={"draftkv_sim": ["default_scenario.json"]},
    python_requires=">=3.10",
    # Loose on purpose: pinning torch here would replace a CUDA build with a CPU one.
    install_requires=["torch", "triton", "numpy", "tqdm"],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "filelock"],
        "plot": ["matplotlib"],
        # The disaggregated pair's transfer engine (NIXL over UCX); without it the torch.distributed wire runs.
        "nixl": ["nixl-cu12==1.5.1"],
    },
    entry_points={"console_scripts": ["draftkv=draftkv_sim.__main__:main"]},
)
