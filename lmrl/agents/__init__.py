"""Agents written elsewhere, trained token-exact: the recording gateway (`gateway`: the live policy at one
OpenAI-compatible endpoint per episode), the programs that drive episodes through it and how they are started
(`programs`: env.name=agent), the work queue of programs that run on their own (`work`: env.agent_mode=serve), and
verifiers environments (`verifiers`). Above `lmrl.rollout`, whose server, batcher and multi-turn episodes they use."""
