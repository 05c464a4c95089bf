"""Chapter experiments: timing studies, sweeps and the data behind the figures, one module per topic.

Nothing here is imported by a training run. The library (``scalebook.parallel``, ``scalebook.train``,
``scalebook.comm``) holds what a run uses; a chapter that measures, compares or sweeps it calls a function
from here, which runs the library on local ranks and returns plain numbers for the notebook to show.
"""
