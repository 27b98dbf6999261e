"""NVIDIA Xid faults as gpuguard judges them (pure): what a code means, and what it stops.

One step per module: ``catalogue`` what each Xid code means (a faulty process, or a GPU no kill
can free); ``events`` a kernel journal line into a typed event; ``faults`` which reset-class
faults stop a unit; ``stuck`` which process an application fault left stuck in the driver.
"""
