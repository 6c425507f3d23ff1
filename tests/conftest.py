import os
import sys

# Tests import the helper modules next to them (models, memory readers).
sys.path.insert(0, os.path.dirname(__file__))
