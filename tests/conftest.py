import os
import sys

# Lets test modules import tests/distributed.py as a plain module.
sys.path.insert(0, os.path.dirname(__file__))
