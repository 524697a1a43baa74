import os
import sys

# tests/distributed.py is imported by the test modules and by spawned worker processes.
sys.path.insert(0, os.path.dirname(__file__))
