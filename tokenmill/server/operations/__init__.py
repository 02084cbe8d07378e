"""Operations routes, belonging to no API: health, metrics and version (:mod:`.status`), and the RL
control routes: weight updates from disk, pause/resume, weight version (:mod:`.rl_control`)."""
