import sys, runpy
import os
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import cpu_patch  # noqa
sys.argv = ["load_probe.py"] + sys.argv[1:]
runpy.run_path(os.path.join(HERE, "..", "load_probe.py"), run_name="__main__")
