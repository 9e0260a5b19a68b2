/* MPI_IN_PLACE as a linkable constant. mpi.h defines it as a macro (Open MPI
 * `(void *) 1`, MPICH `(void *) -1`), which bindgen, and so rsmpi, cannot
 * export; host/build.rs compiles this with the MPI rsmpi is built against. */
#include <mpi.h>

void *const accel_mpi_in_place = MPI_IN_PLACE;
