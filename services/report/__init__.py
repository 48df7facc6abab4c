"""``dracap report``: the Grafana dashboard's panels as one PNG, computed from the event log.

* :mod:`~services.report.panels` -- fold the log (database or exported file) into the
  panels' series;
* :mod:`~services.report.figure` -- draw them (matplotlib, optional);
* :mod:`~services.commands.report` -- the command line.
"""
