"""An installed app of the discovery test (``tests/settings_wf_app.py``): its ``workflows.py``
registers a function step, which a worker must find without any import of its own."""
