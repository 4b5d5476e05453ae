"""Files put first on the PYTHONPATH of a command job's Python processes (see sitecustomize.py)."""
