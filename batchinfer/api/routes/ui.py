"""/ui: the web dashboard. Server-rendered pages and htmx fragments over the REST API's own code paths.

Pages: /ui (upload, your jobs, the workers), /ui/batches/{id} (live progress, tokens/s chart, errors,
cancel, download), /ui/login. Fragments are re-fetched by htmx while something can still change and the
tokens/s chart reads /ui/batches/{id}/timeline. Sign-in and CSRF rules: batchinfer.api.ui.auth. Creating,
cancelling and downloading call the REST routes' functions themselves (with the dashboard's caller), so
the dashboard can do nothing the REST API would refuse, and answers the same (404 for another owner's job).

The admin view: an admin key (`batchinfer apikey create --admin`), or the loopback operator under
`--auth-disabled`, sees every owner's batches (the CLI's and schedules' `local` ones included) with their
owner, and may open, cancel and download any of them through the store's services, as the CLI does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Literal, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Form, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from sqlalchemy.orm import Session

from batchinfer.api.deps import Caller, SessionsDep, SettingsDep
from batchinfer.api.errors import APIError, job_error
from batchinfer.api.limits import upload_slot
from batchinfer.api.routes.batches import cancel_batch, create_batch
from batchinfer.api.routes.files import file_content, receive_owner_upload, store_upload
from batchinfer.api.schemas import CreateBatchRequest
from batchinfer.api.ui.auth import (
    LOGIN_PATH,
    UI_PATH,
    CrossSite,
    LoginRequired,
    NotHtmx,
    UiCallerDep,
    cross_site_handler,
    go_to,
    htmx_only,
    login_required_handler,
    not_htmx_handler,
    read_as_ui,
    same_origin_only,
    sign_in,
    sign_out,
)
from batchinfer.api.ui.templating import STATIC_DIR, render
from batchinfer.api.ui.views import (
    BatchRow,
    batch_view,
    find_job,
    jobs_view,
    timeline_view,
    upload_models,
    workers_view,
)
from batchinfer.store.apikeys import authenticate, is_admin_key
from batchinfer.store.errors import JobError, JobNotFound, JobStateError
from batchinfer.store.export import export_results
from batchinfer.store.jobs import cancel_job
from batchinfer.store.models import Job
from batchinfer.store.serialize import parse_batch_id

View = TypeVar("View")  # what a job page's view function makes of the job
router = APIRouter(prefix=UI_PATH, include_in_schema=False)

BatchId = Annotated[str, Path(max_length=64)]
Htmx = [Depends(htmx_only)]


def install(app: FastAPI) -> None:
    """Serve the dashboard: these routes under /ui, the static files under /ui/static, its error handlers."""
    app.include_router(router)
    app.mount(f"{UI_PATH}/static", StaticFiles(directory=STATIC_DIR), name="ui-static")
    app.add_exception_handler(LoginRequired, login_required_handler)
    app.add_exception_handler(NotHtmx, not_htmx_handler)
    app.add_exception_handler(CrossSite, cross_site_handler)


def _not_found(request: Request, batch_id: str) -> Response:
    return render(request, "not_found.html", {"batch_id": batch_id}, status_code=404)


def _fragment_not_found(request: Request, batch_id: str) -> Response:
    return render(request, "_message.html", {"tone": "bad", "message": f"No batch {batch_id} belongs to your "
                                                                        "key."}, status_code=404)


# --- sign-in ---------------------------------------------------------------------------------------


@router.get("/login")
async def login_form(request: Request, settings: SettingsDep) -> Response:
    """The sign-in form (straight to the dashboard when auth is disabled)."""
    if settings.auth_disabled:
        return go_to(request, UI_PATH)
    return render(request, "login.html", {})


@router.post("/login", dependencies=[Depends(same_origin_only)])
async def login(request: Request, sessions: SessionsDep,
                api_key: Annotated[str, Form(max_length=256)]) -> Response:
    """Check the key like a Bearer token; on success keep it in the dashboard's cookie."""

    def check() -> str | None:
        with sessions() as session:
            return authenticate(session, key=api_key.strip())

    if not api_key.strip() or await run_in_threadpool(check) is None:
        return render(request, "login.html", {"error": "That key is unknown or revoked. Create one with "
                                                       "`batchinfer apikey create --name NAME`."},
                      status_code=401)
    return sign_in(go_to(request, UI_PATH), request, api_key.strip())


@router.post("/logout", dependencies=Htmx)
async def logout(request: Request) -> Response:
    """Forget the key."""
    return sign_out(go_to(request, LOGIN_PATH))


# --- the jobs page ---------------------------------------------------------------------------------


def is_admin(session: Session, caller: Caller) -> bool:
    """The admin view's rule (module docstring): an admin key, or the loopback operator without keys."""
    return caller.settings.auth_disabled or is_admin_key(session, key=caller.api_key)


def _visible_owner(session: Session, caller: Caller, owner: str) -> str | None:
    """Whose jobs the caller sees: its own, or everyone's (None) in the admin view."""
    return None if is_admin(session, caller) else owner


@router.get("")
async def home(request: Request, caller: UiCallerDep) -> Response:
    """Upload a file, your jobs (every owner's in the admin view), the workers."""
    default_model = caller.settings.default_model

    def work(session: Session, owner: str) -> tuple[str, bool, list, list, dict[str, str]]:
        admin = is_admin(session, caller)
        return (owner, admin, jobs_view(session, owner=None if admin else owner), workers_view(session),
                upload_models(session, default_model=default_model))

    owner, admin, jobs, workers, models = await read_as_ui(caller, work)
    shown = next(name for name, model in models.items() if model == default_model)  # a path by its name
    return render(request, "home.html", {"owner": owner, "admin": admin, "jobs": jobs, "workers": workers,
                                         "default_model": shown, "models": list(models)})


@router.get("/jobs")
async def jobs_fragment(request: Request, caller: UiCallerDep) -> Response:
    """The jobs table (re-fetched every few seconds)."""

    def work(session: Session, owner: str) -> tuple[bool, list[BatchRow]]:
        admin = is_admin(session, caller)
        return admin, jobs_view(session, owner=None if admin else owner)

    admin, jobs = await read_as_ui(caller, work)
    return render(request, "_jobs.html", {"jobs": jobs, "admin": admin})


@router.get("/workers")
async def workers_fragment(request: Request, caller: UiCallerDep) -> Response:
    """The workers table (re-fetched every few seconds)."""
    workers = await read_as_ui(caller, lambda s, _: workers_view(s))
    return render(request, "_workers.html", {"workers": workers})


@router.post("/jobs", dependencies=Htmx)
async def upload(request: Request, caller: UiCallerDep, settings: SettingsDep,
                 sessions: SessionsDep) -> Response:
    """Upload a JSONL file and create a batch from it (POST /v1/files + POST /v1/batches), then open it."""
    owner, models = await read_as_ui(
        caller, lambda s, o: (o, upload_models(s, default_model=settings.default_model)))
    try:
        async with upload_slot(request.app, owner, settings):  # the same bounds as POST /v1/files
            received = await receive_owner_upload(request, owner, settings, sessions)
            row = await store_upload(sessions, owner, received, settings)
        body = CreateBatchRequest(input_file_id=row.file_id, endpoint=None,
                                  completion_window=received.fields.get("completion_window") or "24h",
                                  model=_chosen_model(received.fields.get("model", ""), models))
        batch = await create_batch(body=body, request=request, owner=owner, settings=settings,
                                   factory=sessions)
    except (APIError, JobError) as exc:  # a JobError: a field the store refused (the REST answer's message)
        answer = job_error(exc) if isinstance(exc, JobError) else exc
        return render(request, "_message.html", {"tone": "bad", "message": answer.message},
                      status_code=answer.status_code)
    except ValidationError as exc:  # a form field the batch body refuses (too long, say)
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"])
        message = f"Invalid {field}: {error['msg']}."
        return render(request, "_message.html", {"tone": "bad", "message": message}, status_code=400)
    return go_to(request, f"{UI_PATH}/batches/{batch.id}")


def _chosen_model(typed: str, models: dict[str, str]) -> str | None:
    """The model the form names: a served model's shown name (a path's directory name) is that model."""
    typed = typed.strip()
    return models.get(typed, typed) or None


# --- one job ---------------------------------------------------------------------------------------


async def _job_page_data(caller: UiCallerDep, batch_id: str,
                         view: Callable[[Session, Job], View]) -> View | None:
    """view(session, job) for the caller's job (any job in the admin view), or None when it is not theirs
    (or does not exist)."""

    def work(session: Session, owner: str) -> View | None:
        job = find_job(session, owner=_visible_owner(session, caller, owner), batch_id=batch_id)
        return None if job is None else view(session, job)

    return await read_as_ui(caller, work)


@router.get("/batches/{batch_id}")
async def batch_page(request: Request, batch_id: BatchId, caller: UiCallerDep) -> Response:
    """A job: live progress, tokens/s over time, the first errors, cancel and downloads."""
    batch = await _job_page_data(caller, batch_id, batch_view)
    if batch is None:
        return _not_found(request, batch_id)
    return render(request, "batch.html", {"batch": batch})


@router.get("/batches/{batch_id}/status")
async def status_fragment(request: Request, batch_id: BatchId, caller: UiCallerDep) -> Response:
    """The job's progress panel (re-fetched every second while the job can still change)."""
    batch = await _job_page_data(caller, batch_id, batch_view)
    if batch is None:
        return _fragment_not_found(request, batch_id)
    return render(request, "_status.html", {"batch": batch})


@router.get("/batches/{batch_id}/errors")
async def errors_fragment(request: Request, batch_id: BatchId, caller: UiCallerDep) -> Response:
    """The first error lines (re-fetched every few seconds while the job runs)."""
    batch = await _job_page_data(caller, batch_id, batch_view)
    if batch is None:
        return _fragment_not_found(request, batch_id)
    return render(request, "_errors.html", {"batch": batch})


@router.get("/batches/{batch_id}/timeline")
async def timeline(request: Request, batch_id: BatchId, caller: UiCallerDep) -> Response:
    """The tokens/s chart's data (JSON)."""
    data = await _job_page_data(caller, batch_id, timeline_view)
    if data is None:
        return JSONResponse({"error": f"no batch {batch_id}"}, status_code=404)
    return JSONResponse(data)


@router.post("/batches/{batch_id}/cancel", dependencies=Htmx)
async def cancel(request: Request, batch_id: BatchId, caller: UiCallerDep) -> Response:
    """Cancel the job (POST /v1/batches/{id}/cancel; any owner's in the admin view), then show its progress
    panel."""
    try:
        if await read_as_ui(caller, lambda s, _: is_admin(s, caller)):
            return await _admin_cancel(request, batch_id, caller)
        await cancel_batch(batch_id=batch_id, caller=caller, request=request)
    except APIError as exc:
        if exc.status_code == 401:
            raise LoginRequired() from None
        if exc.status_code == 404:
            return _fragment_not_found(request, batch_id)
        return render(request, "_message.html", {"tone": "bad", "message": exc.message},
                      status_code=exc.status_code)
    return await status_fragment(request, batch_id, caller)


@router.get("/batches/{batch_id}/download/{kind}")
async def download(batch_id: BatchId, kind: Literal["output", "errors"], caller: UiCallerDep,
                   request: Request) -> Response:
    """The job's output or error file (GET /v1/files/{id}/content; any owner's in the admin view), as an
    attachment."""
    if await read_as_ui(caller, lambda s, _: is_admin(s, caller)):
        return await _admin_download(request, batch_id, kind, caller)
    job_number = batch_id.removeprefix("batch_")
    file_id = f"file-{'out' if kind == 'output' else 'err'}-{job_number}"
    try:
        response = await run_in_threadpool(file_content, file_id=file_id, caller=caller)
    except APIError as exc:
        if exc.status_code == 401:
            raise LoginRequired() from None
        return _not_found(request, batch_id)
    response.headers["Content-Disposition"] = f'attachment; filename="{batch_id}_{kind}.jsonl"'
    return response



# --- the admin view's actions on any owner's job (the store's services, as the CLI operator uses) ----


async def _admin_cancel(request: Request, batch_id: str, caller: Caller) -> Response:
    job_id = parse_batch_id(batch_id)

    def work(session: Session, _owner: str) -> str | None:
        if job_id is None:
            raise JobNotFound(batch_id)
        cancel_job(session, job_id=job_id)
        return None

    try:
        await read_as_ui(caller, work)
    except JobNotFound:
        return _fragment_not_found(request, batch_id)
    except JobStateError as exc:
        return render(request, "_message.html", {"tone": "bad", "message": f"Cannot cancel a batch with "
                                                                             f"status '{exc.status}'."},
                      status_code=400)
    request.app.state.status_cache.drop(job_id)  # read-your-writes, as the REST route does
    return await status_fragment(request, batch_id, caller)


async def _admin_download(request: Request, batch_id: str, kind: str, caller: Caller) -> Response:
    job = await read_as_ui(caller, lambda s, _: find_job(s, owner=None, batch_id=batch_id))
    if job is None:
        return _not_found(request, batch_id)

    def lines() -> Iterator[bytes]:
        with caller.sessions() as session:
            yield from export_results(session, job_id=job.id, kind="output" if kind == "output" else "errors")

    return StreamingResponse(lines(), media_type="application/jsonl", headers={
        "Content-Disposition": f'attachment; filename="{batch_id}_{kind}.jsonl"'})
