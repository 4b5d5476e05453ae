"""Built-in trainers. Only names here: importing a trainer module imports torch."""

TRAINER_NAMES: tuple[str, ...] = ("unconditional",)
