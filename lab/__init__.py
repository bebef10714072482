"""The lab: the demo target's trainer, measurement scripts and studies (see lab/README.md). Not installed with
the package, and nothing in ``peagle`` imports it."""
