"""Build dynamo_sizebackend and its custom-op library ``dynamo_sizebackend._C``.

Torch must already be installed (``pip install torch==2.13.0``) and the package is
built with ``pip install --no-build-isolation -e .`` so that the extension links
against that torch rather than one pip would fetch into an isolated build env.
"""
import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))

setup(
    name="dynamo_sizebackend",
    version="0.1.0",
    description="A torch.compile backend that splits at attention and compiles per batch size",
    packages=find_packages(exclude=("tests", "tests.*", "benchmarks")),
    python_requires=">=3.10",
    install_requires=["torch==2.13.0", "tqdm"],
    extras_require={"test": ["pytest", "pytest-xdist", "transformers"], "plot": ["matplotlib"]},
    ext_modules=[
        CppExtension(
            "dynamo_sizebackend._C",
            sources,
            extra_compile_args={"cxx": ["-O3", "-fopenmp"]},
            extra_link_args=["-fopenmp"],
            py_limited_api=False,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    entry_points={
        "torch_dynamo_backends": ["sizebackend = dynamo_sizebackend.backend:sizebackend"],
        "console_scripts": ["sizebackend = dynamo_sizebackend.app.cli:main"],
    },
)
