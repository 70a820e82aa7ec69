"""The floor every stage stands on: remat's contracts, as plain torch-free data.

What the stages hand each other (:class:`~remat.core.profile.Profile`,
:class:`~remat.core.plan.Plan`, :class:`~remat.core.option.Option`,
:class:`~remat.core.loop.Loop`), how users write a budget (:mod:`.budget`), the
argument checks every entry point shares (:mod:`.checks`), the errors (:mod:`.errors`),
byte formatting and JSON. It imports no other part of remat and no torch.
"""
