"""The web dashboard's parts: templates, static files (htmx, uPlot, our CSS and JS), sign-in, views.

No Node build: htmx and uPlot ship as their released minified files in static/ (static/THIRD_PARTY.md
names their versions and licenses), our own JS is one small file, pages are Jinja templates rendered by
the API (templating.py). The routes, and `install` that mounts it all under /ui: batchinfer.api.routes.ui.
"""
