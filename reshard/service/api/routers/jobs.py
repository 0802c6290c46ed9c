"""Write jobs: `POST /v1/checkpoints/{name}/jobs`, `GET /v1/jobs`, `GET /v1/jobs/{id}`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response

from reshard.layout.mesh import Layout
from reshard.service.api.deps import JobsDep, Name
from reshard.service.api.schemas import JobIn, JobOut
from reshard.service.http_errors import error_responses

router = APIRouter(tags=["jobs"])


@router.post(
    "/v1/checkpoints/{name}/jobs",
    status_code=202,
    response_model=JobOut,
    summary="Write rank files in the background",
    description="Plans the layout (`tp`, and `pp`, `fsdp`, `ep`, `dp_replicate`: all ranks, or `ranks`) now and "
    "answers 202; the rank files, config.json and reshard.json are then written atomically to OUT/NAME/tp-N "
    "(OUT/NAME/pp-2-fsdp-2-tp-2-ep-4 for a layout beyond tp). Poll `GET /v1/jobs/{id}`. While the "
    "server's job database cannot be written, answers 507 (its file system is full) or 503.",
    responses=error_responses(400, 401, 404, 422, 503, 507),
)
def submit_job(name: Name, body: JobIn, jobs: JobsDep, response: Response) -> JobOut:
    job = jobs.submit(name, Layout.from_sizes(body), ranks=body.ranks, rules=body.rules)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobOut(**job.to_json())


@router.get("/v1/jobs", response_model=list[JobOut], summary="Known jobs, oldest first",
            responses=error_responses(401, 503, 507))
def list_jobs(jobs: JobsDep) -> list[JobOut]:
    return [JobOut(**j.to_json()) for j in jobs.list_jobs()]


@router.get(
    "/v1/jobs/{job_id}",
    response_model=JobOut,
    summary="A job's state, bytes done / total, output paths and error",
    responses=error_responses(401, 404, 422, 503, 507),
)
def get_job(job_id: Annotated[str, Path(max_length=64)], jobs: JobsDep) -> JobOut:
    return JobOut(**jobs.get(job_id).to_json())
