"""`python -m cuda.gpu_check`: see cuda/gpu_check/__init__.py."""
import sys

from cuda.gpu_check import main

sys.exit(main())
