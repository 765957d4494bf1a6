"""Tests of cptune.parallel.kernels. Not named ``kernels``: a script run from tests/parallel would then
shadow the ``kernels`` package (bitsandbytes does ``from kernels import get_kernel``)."""
