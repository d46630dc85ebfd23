"""Hydra finds launchers only under hydra_plugins: harness's Slurm launcher, registered here."""

from harness.launch.slurm import SlurmArrays


class HarnessSlurmLauncher(SlurmArrays):
    """hydra/launcher=harness_slurm (harness/launch/slurm.py)."""
