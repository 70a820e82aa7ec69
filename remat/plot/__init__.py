"""Figures: :func:`plot_pareto` (:mod:`remat.plot.pareto`), its labels placed clear of each
other (:mod:`remat.plot.labels`). matplotlib is imported when a figure is drawn."""

from remat.plot.pareto import PlotError, plot_pareto

__all__ = ["PlotError", "plot_pareto"]
