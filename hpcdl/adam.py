"""Adam's constants (Kingma & Ba's), one set for the engine's Adam inside a group
(hpcdl.engine.optim) and the applier's (hpcdl.applier.rules): the same rule on both sides of the
exchange."""

ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON = 0.9, 0.999, 1e-8
