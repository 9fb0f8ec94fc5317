"""Builds the optional C kernels of the parameter server (fleetx/ps/_kernels.c) and the slot
text parser of the datasets (fleetx/data/_slots.c).

Everything else is declared in pyproject.toml. The extensions are optional: without a C compiler
the install still succeeds and fleetx.ps falls back to its numpy kernels (slower shards),
fleetx.data to its numpy parser (slower loads).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("fleetx.ps._kernels", ["fleetx/ps/_kernels.c"],
                             extra_compile_args=["-O3", "-std=c99", "-fno-math-errno"], optional=True),
                   Extension("fleetx.data._slots", ["fleetx/data/_slots.c"],
                             extra_compile_args=["-O3", "-std=c99"], optional=True)])
