import sys, runpy
import os
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import cpu_patch  # noqa
sys.argv = ["async_ab.py"] + sys.argv[1:]
runpy.run_path(os.path.join(HERE, "..", "async_ab.py"), run_name="__main__")
