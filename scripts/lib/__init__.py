"""What the scripts share, outside the installed package: `from lib import bench` in a script
(its folder is first on sys.path), `from scripts.lib import bench` in the tests.

  bench.py   measurements side by side (the walks, one graph, mlx-lm's step), random models of
             mlxwalk.shapes' shapes, the largest window that fits
  jobs.py    benchmark jobs in child processes, their marked results read back
"""
