"""Stage 5, rendering: tables, ``--json``, the terminal timeline chart, SVG and the HTML
report. No arithmetic on memory here: numbers come from the estimate and the plan."""
