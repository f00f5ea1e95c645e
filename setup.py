"""What pyproject.toml cannot say: the package list under the kernels/ -> sdcp_fast.kernels mapping.

(The optional CUDA extension, when csrc/ holds one, is built on demand at run time with
torch's extension loader on CUDA machines only, so nothing is compiled here.)
"""

from setuptools import find_packages, setup

packages = ["sdcp_fast", *(f"sdcp_fast.{p}" for p in find_packages("sdcp_fast"))]
packages += ["sdcp_fast.kernels", *(f"sdcp_fast.kernels.{p}" for p in find_packages("kernels"))]

setup(packages=packages)
