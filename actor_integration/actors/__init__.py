"""The actor glue: `mixin` (`LifecycleMixin`, the lifecycle inside one actor) and `ray_group`
(`LifecycleGroup`, the driver's fan-out to a group of Ray actors). The frameworks' own actor classes
are wrapped beside these, in `actor_integration.frameworks`.
"""
