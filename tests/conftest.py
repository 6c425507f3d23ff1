import os
import sys

# Tests import the helper modules next to them (models, memory readers).
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):  # type: ignore[no-untyped-def]
    config.addinivalue_line(
        "markers", "inductor: compiles with torch.compile's inductor backend (builds C++, slow)"
    )
