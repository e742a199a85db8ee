"""What wires the rooms below into the commands that serve: ``serve`` (``phasewise serve`` and
``phasewise router``: an engine or a router behind the HTTP server, with the P/D worker around
the engine for ``--role prefill|decode``) and ``pd`` (``phasewise pd``: one prefill worker, one
decode worker and a router as three processes). Above ``server`` and ``disagg``, which import
neither each other nor this."""
