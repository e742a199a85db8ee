"""Hardware and model catalogs, roofline cost model, measurement of this machine.

Nothing here imports torch at module import time.
"""
