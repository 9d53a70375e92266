"""The course's tooling, apart from what the notebooks teach: what a node has (:mod:`.doctor`,
:mod:`.gpu_diagnosis`), the instructor's check before a session (:mod:`.preflight`), executing
every notebook (:mod:`.course`, ``make course``), students' working copies (:mod:`.workspace`,
``make lab``) and copies without solutions (:mod:`.exercises`, ``make student``), and the nbval
plugin that runs those copies (:mod:`.nbval_student`). Reached through ``python -m course_utils``
and the Makefile; notebook 01 prints :func:`.doctor.render`'s report.
"""
